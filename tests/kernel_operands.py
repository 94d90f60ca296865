"""Where the operands of a lowered program's kernel custom calls come from (StableHLO, MLIR API).

``kernel_operand_sources(module)`` follows each operand of every ``stablehlo.custom_call`` back to
its origin through the ops that pass a buffer on unchanged or update it in place (``reshape``,
``bitcast_convert`` of equal width, ``scatter``'s operand, ``optimization_barrier``), through
``func.call`` (into the callee's ``return``) and private functions' arguments (to every call
site), and through ``stablehlo.while`` (a body argument is the loop carry: followed to the
``while``'s init operand). It stops at an argument of ``@main`` (a root) or at any other op, e.g.
``dynamic_slice``, ``slice``, ``gather``, ``copy``, ``concatenate``: the operand is then a new
array computed from its source, which XLA materialises before the custom call.

What this sees and what it cannot: it reads the program XLA is given, before XLA's passes. A
``dynamic_slice`` feeding a custom call is a copy on every backend (a custom call's operand is a
buffer; XLA cannot fuse a slice into it). The reverse is not guaranteed: a clean chain here can
still get a copy from XLA's copy insertion or layout assignment (e.g. if the scatter is not done
in place); only the compiled program shows that (``compiled.memory_analysis()`` on the device).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from jax._src.lib.mlir import ir

PASS_THROUGH = {"stablehlo.reshape", "stablehlo.optimization_barrier"}
IN_PLACE = {"stablehlo.scatter"}  # result i updates operand i


@dataclass(frozen=True)
class Source:
    """One origin of a custom call operand: ``path`` the op names crossed (callee side first),
    ``root`` ``"main:<i>"`` for argument ``i`` of ``@main``, else the op that made the value."""

    path: tuple[str, ...]
    root: str

    @property
    def clean(self) -> bool:
        return self.root.startswith("main:")


def _functions(module: ir.Module) -> dict[str, ir.Operation]:
    return {op.attributes["sym_name"].value: op.operation for op in module.body.operations
            if op.operation.name == "func.func"}


def _ops(op: ir.Operation):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner.operation
                yield from _ops(inner.operation)


def _callers(module: ir.Module) -> dict[str, list[ir.Operation]]:
    out: dict[str, list[ir.Operation]] = {}
    for fn in _functions(module).values():
        for op in _ops(fn):
            if op.name == "func.call":
                out.setdefault(op.attributes["callee"].value, []).append(op)
    return out


def _sources(value, path, funcs, callers, stack=(), depth=0) -> list[Source]:
    """``stack``: the ``func.call`` ops entered through their results; a callee's argument leads
    back to the innermost of them, or to every call site when none was entered."""
    if depth > 400:
        return [Source(path, "too deep")]
    step = functools.partial(_sources, funcs=funcs, callers=callers, depth=depth + 1)
    if isinstance(value, ir.BlockArgument):
        parent = value.owner.owner.operation
        i = value.arg_number
        if parent.name == "func.call" or parent.name != "func.func" and parent.name != "stablehlo.while":
            return [Source(path, f"argument of {parent.name}")]
        if parent.name == "stablehlo.while":
            return step(parent.operands[i], path + ("while carry",), stack=stack)
        name = parent.attributes["sym_name"].value
        if name == "main":
            return [Source(path, f"main:{i}")]
        if stack:
            return step(stack[-1].operands[i], path + ("call",), stack=stack[:-1])
        sites = callers.get(name, [])
        return [s for call in sites for s in step(call.operands[i], path + ("call",), stack=())] or \
            [Source(path, f"uncalled @{name}")]
    op = value.owner.operation
    k = value.result_number
    if op.name in PASS_THROUGH or op.name in IN_PLACE:
        src = op.operands[k if op.name != "stablehlo.reshape" else 0]
        return step(src, path + (op.name.split(".")[-1],), stack=stack)
    if op.name == "func.call":
        callee = funcs[op.attributes["callee"].value]
        ret = list(callee.regions[0].blocks[0].operations)[-1].operation
        return step(ret.operands[k], path + ("return",), stack=stack + (op,))
    if op.name == "stablehlo.while":
        return step(op.operands[k], path + ("while",), stack=stack)
    return [Source(path, op.name)]


@dataclass(frozen=True)
class KernelOperand:
    """Operand ``index`` (``shape``, a tuple) of custom call ``target`` (``kernel``: its
    ``name`` from the backend config when present) and where it comes from."""

    target: str
    kernel: str
    index: int
    shape: tuple[int, ...]
    sources: tuple[Source, ...]


def _kernel_name(op: ir.Operation) -> str:
    cfg = str(op.attributes["mhlo.backend_config"]) if "mhlo.backend_config" in op.attributes else ""
    start = cfg.find('name = "')
    return cfg[start + 8:cfg.find('"', start + 8)] if start >= 0 else ""


def kernel_operand_sources(module: ir.Module) -> list[KernelOperand]:
    """Every operand of every ``stablehlo.custom_call`` in ``module`` (``lowered.compiler_ir(
    "stablehlo")``) with its sources (module docstring)."""
    funcs, callers = _functions(module), _callers(module)
    out = []
    for fn in funcs.values():
        for op in _ops(fn):
            if op.name != "stablehlo.custom_call":
                continue
            target = op.attributes["call_target_name"].value
            for i, v in enumerate(op.operands):
                shape = tuple(ir.RankedTensorType(v.type).shape)
                out.append(KernelOperand(target, _kernel_name(op), i, shape,
                                         tuple(_sources(v, (), funcs, callers))))
    return out
