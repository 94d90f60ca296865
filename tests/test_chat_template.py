"""Chat templates (``model.chat_template``): prompts rendered from the tokenizer's own jinja
template equal transformers' ``apply_chat_template`` on the same local files: SmolLM2-135M-Instruct
(imported offline, ``smollm2_dir``) and a Qwen2.5-style tokenizer built here (Qwen2.5-Instruct's
chat template, tools branch included, over a small word-level vocabulary); the config key picks
it, and asking for a template the tokenizer lacks fails before any work naming the key.
"""

from __future__ import annotations

import json

import pytest

from rhyme_jax.config import ConfigError, load_config
from rhyme_jax.data import Problem
from rhyme_jax.model.chat_template import ChatTemplateError, select, tokenizer_chat_template
from rhyme_jax.model.tokenizer import Tokenizer
from rhyme_jax.train.policy import build_tokenizer
from rhyme_jax.train.preflight import prepare
from rhyme_jax.train.prompts import PromptTokens

# Qwen2.5-Instruct's chat template (its structure: tools block, default system turn, tool calls
# and tool responses, generation prompt).
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The other features transformers' renderer provides: tojson without HTML escaping, loop
# controls, {% generation %}, special-token variables, whitespace control (trim / lstrip blocks).
FEATURES_TEMPLATE = """{% for m in messages %}
    {% if loop.index > 2 %}{% break %}{% endif %}
  [{{ m.role }}] {{ m.content | tojson }}
{% endfor %}
{% generation %}{{ bos_token }}|{{ eos_token }}|{{ pad_token }}{% endgeneration %}
{% if add_generation_prompt %}>>{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}],
    [{"role": "system", "content": "Reason step by step; answer after ####."},
     {"role": "user", "content": "Line one\nline two {braces} & <tags> \"quotes\" ünïcode 数学"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "times 3?"}],
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris <FR>", "unit": "°C"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": "sunny"},
]


def _qwen_style_dir(directory, template=QWEN25_TEMPLATE):
    """A tokenizer directory transformers and ``Tokenizer.from_file`` both read: a word-level
    tokenizer.json with Qwen2.5's special tokens and a tokenizer_config.json carrying ``template``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate([*specials, "[UNK]", "user", "assistant", "system", "2+2?"])}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": "[UNK]",
              "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _hf_render(directory, messages, add_generation_prompt=True):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smollm2_dir, add_generation_prompt):
    ours = tokenizer_chat_template(smollm2_dir)
    assert ours.source.endswith("chat_template.jinja")  # transformers' own file, written by the import
    for messages in CONVERSATIONS:
        got = ours.render(messages, add_generation_prompt=add_generation_prompt)
        assert got == _hf_render(smollm2_dir, messages, add_generation_prompt)


def test_smollm2_recipe_prompt_is_its_chat_template(smollm2_dir, tmp_path):
    """``model.chat_template: tokenizer`` renders the text the SmolLM2 recipes spell out in
    ``model.prompt_template`` (the template's default system turn)."""
    recipe = load_config("configs/arith_smollm2_135m.yaml", [f"model.path={smollm2_dir}"])
    cfg = load_config("configs/arith_smollm2_135m.yaml", [f"model.path={smollm2_dir}", "model.chat_template=tokenizer"])
    tok = build_tokenizer(cfg, tmp_path, [])
    question = "Ann has 5 pens and gives away 2. How many are left?"
    assert tok.format_prompt(cfg.model.prompt_template, question) == recipe.model.prompt_template.format(question=question)
    assert tok.format_prompt("unused", question) == _hf_render(smollm2_dir, [{"role": "user", "content": question}])
    tokens = PromptTokens(tok, [Problem(id=0, question=question, solution="#### 3", answer="3")], cfg.model.prompt_template)
    assert tokens(0) == tok.encode(recipe.model.prompt_template.format(question=question))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen25_template_matches_transformers(tmp_path, add_generation_prompt):
    directory = _qwen_style_dir(tmp_path / "qwen")
    ours = tokenizer_chat_template(directory)
    for messages in [*CONVERSATIONS, TOOL_CONVERSATION]:
        got = ours.render(messages, add_generation_prompt=add_generation_prompt)
        assert got == _hf_render(directory, messages, add_generation_prompt)
    assert ours.prompt("2+2?") == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                                   "assistant.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_renderer_features_match_transformers(tmp_path):
    directory = _qwen_style_dir(tmp_path / "features", FEATURES_TEMPLATE)
    messages = [*CONVERSATIONS[1], {"role": "user", "content": "dropped by the break"}]
    got = tokenizer_chat_template(directory).render(messages)
    assert got == _hf_render(directory, messages)
    assert '"Line one\\nline two {braces} & <tags> \\"quotes\\" ünïcode 数学"' in got  # no HTML escaping
    assert "dropped" not in got  # {% break %}
    assert got.endswith('"\n|<|im_end|>|<|endoftext|>>>')  # no bos_token; trim_blocks ate the newlines after tags


def test_raise_exception_and_jinja_file_and_named_templates(tmp_path):
    directory = _qwen_style_dir(tmp_path / "q")
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[0].role != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}"
                      "{{ messages[0].content }}{{ eos_token }}")
    chat = select(str(strict), directory)
    assert chat.prompt("hi") == "hi<|im_end|>"
    with pytest.raises(ChatTemplateError, match="strict.jinja: the chat template failed: first turn must be user"):
        chat.prompt("hi", system_prompt="sys")
    # tokenizer_config.json's list form: the "default" entry, as transformers picks it
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_chat_template(directory).prompt("x") == "D<|im_end|>" == _hf_render(directory, [{"role": "user", "content": "x"}])


def test_config_selects_the_template(tmp_path):
    qwen = _qwen_style_dir(tmp_path / "qwen")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((qwen / "tokenizer.json").read_bytes())
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    base = [f"run.runs_dir={tmp_path / 'runs'}", "model.prompt_template='Q: {question}\\n'"]

    def tok(path, *extra):
        return build_tokenizer(load_config(None, [*base, f"model.tokenizer_path={path / 'tokenizer.json'}", *extra]),
                               tmp_path / "run", [])

    sys_turn = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok(qwen, "model.chat_template=tokenizer", "model.system_prompt='Be brief.'").format_prompt("", "2+2?") == sys_turn
    assert tok(qwen, "model.chat_template=auto").format_prompt("Q: {question}\n", "2+2?").startswith("<|im_start|>system\nYou are Qwen")
    assert tok(qwen).format_prompt("Q: {question}\n", "2+2?") == "Q: 2+2?\n"  # none: the default
    assert tok(plain, "model.chat_template=auto").format_prompt("Q: {question}\n", "2+2?") == "Q: 2+2?\n"
    assert isinstance(Tokenizer.from_file(qwen), Tokenizer)
    cfg = load_config(None, [*base, f"model.tokenizer_path={plain / 'tokenizer.json'}", "model.chat_template=tokenizer"])
    with pytest.raises(ConfigError, match=r"^model\.chat_template='tokenizer' but the tokenizer in .*plain has no chat template"):
        prepare(cfg)
    with pytest.raises(ChatTemplateError, match=r"^model\.chat_template='tokenizer'"):
        build_tokenizer(cfg, tmp_path / "run", [])
    demo = load_config(None, [*base, "model.chat_template=tokenizer"])  # the demo tokenizer has none
    with pytest.raises(ConfigError, match=r"^model\.chat_template='tokenizer' but the tokenizer"):
        prepare(demo)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"^model\.chat_template='.*bad\.jinja': .*not a valid jinja chat template"):
        prepare(load_config(None, [*base, f"model.chat_template={bad}"]))


@pytest.mark.parametrize("override, message", [
    ("model.chat_template=missing.jinja", r"model\.chat_template='missing\.jinja' must be none, auto, tokenizer or an existing jinja file"),
    ("model.system_prompt=hi", r"model\.system_prompt='hi' needs a model\.chat_template"),
])
def test_chat_template_keys_are_checked_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
