"""The dataflow check of a compiled kernel's PTX: what feeds each ``ex2.approx``.

The GPU compiler contracts ``a*c - b`` into one fused multiply-add, so a softmax exponent written
``exp2(s*LOG2E - m*LOG2E)`` becomes ``exp2(fma(s, LOG2E, -round(m*LOG2E)))``: for a row maximum m near -1e9 (OpenFold's
mask bias) the rounding error of the separately scaled maximum, up to 64, becomes the exponent of a key whose score
equals the maximum, which should be exactly 0. Triton's interpreter rounds each operation apart and never shows it.
Subtracting before scaling, ``exp2((s - m) * LOG2E)``, is exact where s == m whatever the compiler fuses. The PTX of a
compiled kernel is text, so which form each ``ex2`` takes is checked without a GPU (:func:`unsafe_exponents`).

The same dataflow shows how each global load and store gets its address: :func:`narrow_addresses` flags a 32-bit
product of a position and a size widened only at the end (overflow past 2^31 elements).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional


@dataclasses.dataclass(frozen=True)
class PtxInstruction:
    line: int  # 1-based line of the PTX text
    opcode: str  # e.g. "fma.rn.f32"
    operands: tuple[str, ...]  # destination first; a vector "{%r1, %r2}" stays one operand

    def __str__(self) -> str:
        return f"line {self.line}: {self.opcode} {', '.join(self.operands)}"


_PTX_REGISTER = re.compile(r"%[A-Za-z_$][\w$]*")
#: opcodes whose first operand is not a register they define
_PTX_NO_DEST = ("st.", "red.", "bra", "bar.", "ret", "exit", "call", "cp.async", "prefetch", "fence", "membar",
                "trap", "wgmma.fence", "wgmma.commit", "wgmma.wait")
#: copies and conversions: a value's origin is their source operand
_PTX_TRANSPARENT = ("mov.", "cvt.")


def parse_ptx(ptx: str) -> list[PtxInstruction]:
    """The instructions of a PTX text (directives, labels, braces and comments skipped; predicates dropped)."""
    out = []
    for number, raw in enumerate(ptx.splitlines(), start=1):
        line = raw.split("//", 1)[0].strip()
        while line.startswith("$") and ":" in line:  # a label before an instruction
            line = line.split(":", 1)[1].strip()
        if not line or line.startswith((".", "{", "}", "(", ")")) or not line.endswith(";"):
            continue
        line = line[:-1].strip()
        if line.startswith("@"):  # @%p1 / @!%p1 predicate
            line = line.split(None, 1)[1] if " " in line else ""
        opcode, _, rest = line.partition(" ")
        if not opcode or not opcode[0].isalpha():
            continue
        operands, depth, current = [], 0, ""
        for ch in rest:  # split on top-level commas (vectors "{a, b}" and addresses "[a + 4]" stay whole)
            depth += (ch in "{[") - (ch in "}]")
            if ch == "," and depth == 0:
                operands.append(current.strip())
                current = ""
            else:
                current += ch
        if current.strip():
            operands.append(current.strip())
        out.append(PtxInstruction(number, opcode, tuple(operands)))
    return out


def _is_zero_immediate(operand: str) -> bool:
    return operand in ("0f00000000", "0f80000000", "0d0000000000000000", "0d8000000000000000", "0", "0.0")


def _is_register(operand: str) -> bool:
    return bool(_PTX_REGISTER.fullmatch(operand))


class _PtxValues:
    """Definitions of PTX registers, to trace where a value comes from (a register may be defined several times:
    loop-carried values are moved into the same register at the loop's end)."""

    def __init__(self, instructions: list[PtxInstruction]):
        self.defs: dict[str, list[PtxInstruction]] = {}
        for inst in instructions:
            if not inst.operands or inst.opcode.startswith(_PTX_NO_DEST):
                continue
            for reg in _PTX_REGISTER.findall(inst.operands[0]) if inst.operands[0].startswith("{") else \
                    [inst.operands[0]] if _is_register(inst.operands[0]) else []:
                self.defs.setdefault(reg, []).append(inst)

    def origins(self, operand: str, _seen: Optional[set] = None) -> list:
        """The instructions (or immediates, as strings) a value comes from, looking through moves, conversions and
        selects (both selected values). Registers without a definition (kernel parameters) come back as names."""
        if not _is_register(operand):
            return [operand]
        seen = set() if _seen is None else _seen
        if operand in seen:
            return []
        seen.add(operand)
        out: list = []
        for inst in self.defs.get(operand, []) or [operand]:
            if isinstance(inst, str):
                out.append(inst)
            elif inst.opcode.startswith(_PTX_TRANSPARENT) and len(inst.operands) == 2:
                out += self.origins(inst.operands[1], seen)
            elif inst.opcode.startswith("selp.") and len(inst.operands) == 4:
                out += self.origins(inst.operands[1], seen) + self.origins(inst.operands[2], seen)
            else:
                out.append(inst)
        return out

    def is_difference(self, operand: str) -> bool:
        """Whether every origin of the value is a subtraction of two registers (``x - y``, or ``x + neg(y)``)."""
        origins = self.origins(operand)
        return bool(origins) and all(self._difference(o) for o in origins)

    def _difference(self, origin) -> bool:
        if not isinstance(origin, PtxInstruction) or len(origin.operands) != 3:
            return False
        a, b = origin.operands[1:]
        if origin.opcode.startswith("sub.f"):
            return _is_register(a) and _is_register(b)
        if origin.opcode.startswith("add.f"):
            return any(isinstance(o, PtxInstruction) and o.opcode.startswith("neg.f")
                       for x in (a, b) for o in self.origins(x))
        return False

    def from_fma(self, operand: str) -> bool:
        return any(isinstance(o, PtxInstruction) and o.opcode.startswith("fma.") for o in self.origins(operand))

    def describe(self, operand: str, depth: int = 4) -> str:
        """A value as a short expression, e.g. ``neg(selp(0f00000000, mul(max(...), 0f3FB8AA3B)))``."""
        if not _is_register(operand) or depth == 0:
            return operand if _is_register(operand) or depth else "..."
        insts = self.defs.get(operand, [])
        if len(insts) != 1:
            return operand
        inst = insts[0]
        op = inst.opcode.split(".")[0]
        return f"{op}({', '.join(self.describe(x, depth - 1) for x in inst.operands[1:])})"


def unsafe_exponents(ptx: str) -> tuple[int, list[str]]:
    """(number of ``ex2`` instructions, one message per ``ex2`` whose argument is not a scaled difference).

    The rule: after moves, conversions and selects, every ``ex2`` argument must be

    - a product ``mul(x, c)`` (or ``fma(x, c, 0)``) with a factor that is a difference of two registers
      (``(s - m) * log2 e``: exact where s == m, whatever the compiler fuses), or
    - a difference of two registers neither of which comes from an ``fma`` (already scaled separately), or
    - an immediate.

    Anything else is flagged, in particular ``fma(s, log2 e, b)`` with a register addend: ``s*LOG2E - m*LOG2E``
    contracted by the compiler into one fused multiply-add whose addend ``b = -round(m*LOG2E)`` carries the rounding
    error of the scaled maximum into the exponent.
    """
    instructions = parse_ptx(ptx)
    values = _PtxValues(instructions)
    exps = [inst for inst in instructions if inst.opcode.startswith("ex2.")]
    problems = []
    for ex2 in exps:
        for origin in values.origins(ex2.operands[1]):
            why = _exponent_problem(values, origin)
            if why:
                problems.append(f"{ex2}: argument {why}")
    return len(exps), problems


def _exponent_problem(values: _PtxValues, origin) -> str:
    """Why an ex2 argument's origin is unsafe, or "" if it is a scaled difference."""
    if not isinstance(origin, PtxInstruction):
        return "" if not _is_register(origin) else f"is the parameter {origin}, not a scaled difference"
    op, operands = origin.opcode, origin.operands
    if op.startswith("fma.") and len(operands) == 4:
        a, b, c = operands[1:]
        if not _is_zero_immediate(c):
            return (f"comes from a fused multiply-add ({origin}) with addend {c} = {values.describe(c)}: "
                    f"the scale is applied before the subtraction")
        if values.is_difference(a) or values.is_difference(b):
            return ""
        return f"comes from {origin}, a product of no difference"
    if op.startswith("mul.f") and len(operands) == 3:
        if values.is_difference(operands[1]) or values.is_difference(operands[2]):
            return ""
        return f"comes from {origin}, a product of no difference (x - max)"
    if values._difference(origin):
        fused = [x for x in operands[1:] if values.from_fma(x)]
        if not fused:
            return ""
        return f"comes from {origin}, a difference with an operand from a fused multiply-add ({', '.join(fused)})"
    return f"comes from {origin}, not a scaled difference"


# ---- 64-bit addressing -------------------------------------------------------------------------------------

_ADDRESS = re.compile(r"^\[\s*(%[\w$]+)")
_PARAM = re.compile(r"^\[(\w+_param_(\d+))\]$")
#: integer ops a 64-bit address is built with: their register operands are followed back
_PTX_INT64 = ("add.s64", "add.u64", "sub.s64", "sub.u64", "mul.lo.s64", "mul.lo.u64", "mad.lo.s64", "mad.lo.u64",
              "shl.b64", "and.b64", "or.b64", "mov.b64", "mov.u64", "mov.s64", "selp.b64", "selp.u64", "selp.s64",
              "cvta.")
#: 32-bit products: a position times a stride or an element size overflows here first
_PTX_MUL32 = ("mul.lo.s32", "mul.lo.u32", "mad.lo.s32", "mad.lo.u32", "shl.b32")
#: a program id (the launch position) and a kernel argument (a size or a stride) in a value's ancestry
_PTX_PROGRAM = re.compile(r"%ctaid")
_PTX_ARGUMENT = re.compile(r"_param_\d+")


def _global_address(inst: PtxInstruction) -> Optional[str]:
    """The address register of a global load or store (``ld.global``, ``st.global``, ``cp.async``), else None."""
    if inst.opcode.startswith("st.global"):
        operand = inst.operands[0]
    elif inst.opcode.startswith(("ld.global", "cp.async.")) and not inst.opcode.startswith(
            ("cp.async.commit", "cp.async.wait")) and len(inst.operands) > 1:
        operand = inst.operands[1]
    else:
        return None
    match = _ADDRESS.match(operand)
    return match.group(1) if match else None


def narrow_addresses(ptx: str, skip_params: frozenset = frozenset()) -> list[str]:
    """The global loads and stores of a kernel's PTX whose address is a 32-bit product widened at the end (one
    message each; empty: every address of a position-indexed buffer is 64-bit arithmetic on the position).

    Each address register is followed back through 64-bit integer arithmetic (adds, 64-bit multiplies and shifts,
    moves, selects) to the kernel parameter it starts from (``ld.param.u64 [k_param_i]``; buffers whose index is in
    ``skip_params``, the weights indexed by channels only, are left out) and to the 32-bit values widened into it
    (``cvt.s64.s32``, ``mul.wide.s32``). A widened value flags the access when, through 32-bit adds, moves and
    selects (the subtrahend of a difference left out: ``x - q * d`` is a remainder, bounded by ``x``), it is a 32-bit
    product (``mul.lo.s32``, ``mad.lo.s32``, ``shl.b32``) of two registers that between them depend on the launch (a
    program id) and on a kernel argument (a size or a stride): a position times a stride computed in 32 bits, which
    overflows past 2^31 elements before the widening. Products by an immediate (a tile size) and of thread indices
    pass: the check cannot see magnitudes, so a position times a compile-time constant is not flagged."""
    instructions = parse_ptx(ptx)
    values = _PtxValues(instructions)
    problems = []
    for inst in instructions:
        address = _global_address(inst)
        if address is None:
            continue
        params, narrow = set(), []
        _trace64(values, address, params, narrow, set())
        if narrow and not (params and params <= skip_params):
            problems.append(f"{inst}: address from {', '.join(narrow)}")
    return problems


def _trace64(values: _PtxValues, reg: str, params: set, narrow: list, seen: set) -> None:
    """Follow a 64-bit address value back (:func:`narrow_addresses`), collecting parameter indices and the widened
    32-bit products."""
    if not _is_register(reg) or reg in seen:
        return
    seen.add(reg)
    for inst in values.defs.get(reg, []):
        op, sources = inst.opcode, inst.operands[1:]
        if op.startswith("ld.param"):
            match = _PARAM.match(sources[0]) if sources else None
            if match:
                params.add(int(match.group(2)))
        elif op.startswith(("mul.wide.", "cvt.s64.", "cvt.u64.")):
            for source in sources:
                if _is_register(source) and _product32(values, source, set()):
                    narrow.append(f"{op} of {values.describe(source)}")
        elif op.startswith(_PTX_INT64):
            for source in sources:
                _trace64(values, source, params, narrow, seen)


def _product32(values: _PtxValues, reg: str, seen: set) -> bool:
    """Whether a 32-bit value is (through adds, moves and selects) a 32-bit product of a launch-dependent value."""
    if not _is_register(reg) or reg in seen:
        return False
    seen.add(reg)
    for inst in values.defs.get(reg, []):
        sources = [s for s in inst.operands[1:] if _is_register(s)]
        if inst.opcode.startswith(_PTX_MUL32):
            factors = inst.operands[1:3]  # a product by an immediate (a tile size) is bounded by its index: left out
            if all(f.startswith("%") for f in factors) and \
                    any(_depends(values, f, _PTX_PROGRAM, set()) for f in factors) and \
                    any(_depends(values, f, _PTX_ARGUMENT, set()) for f in factors):
                return True
        elif inst.opcode.startswith("sub."):  # x - q * d (a remainder): bounded by x, whatever q * d is
            if _product32(values, sources[0], seen) if sources else False:
                return True
        elif inst.opcode.startswith(("add.", "mov.", "selp.", "or.", "and.")):
            if any(_product32(values, s, seen) for s in sources[:2]):
                return True
    return False


def _depends(values: _PtxValues, reg: str, what: re.Pattern, seen: set) -> bool:
    """Whether a value depends on an operand matching ``what`` (a program id, or a kernel argument's load)."""
    if what.search(reg):
        return True
    if not _is_register(reg) or reg in seen:
        return False
    seen.add(reg)
    return any(what.search(" ".join(inst.operands[1:])) or any(_depends(values, s, what, seen)
                                                               for s in inst.operands[1:])
               for inst in values.defs.get(reg, []))
