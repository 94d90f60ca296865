#!/usr/bin/env bash
# Start one rhyme-jax process per host over ssh (docs/gpu_tpu.md, "Several hosts").
#
#   examples/launch_multihost.sh "host0 host1" configs/gsm8k_qwen2.5_1.5b.yaml [--set KEY=VALUE ...]
#
# Every host needs the repository at the same path ($REPO, default: this checkout's path) with
# its .venv installed, and run.runs_dir on a file system every host shares. Host 0 is the
# coordinator (port $PORT, default 1234). Logs: launch_<host>.log in the working directory.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 \"HOST0 HOST1 ...\" CONFIG [rhyme-jax train flags]" >&2
  exit 2
fi
read -r -a HOSTS <<< "$1"
CONFIG=$2
shift 2
REPO=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}
PORT=${PORT:-1234}
N=${#HOSTS[@]}
for i in "${!HOSTS[@]}"; do
  host=${HOSTS[$i]}
  ssh "$host" "cd '$REPO' && . .venv/bin/activate && \
    RHYME_COORDINATOR_ADDRESS=${HOSTS[0]}:$PORT RHYME_NUM_PROCESSES=$N RHYME_PROCESS_ID=$i \
    rhyme-jax train --config '$CONFIG' $*" > "launch_$host.log" 2>&1 &
done
wait
