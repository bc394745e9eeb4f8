"""The dataflow check of a compiled kernel's PTX: what feeds each ``ex2.approx``.

The GPU compiler contracts ``a*c - b`` into one fused multiply-add, so a softmax exponent written
``exp2(s*LOG2E - m*LOG2E)`` becomes ``exp2(fma(s, LOG2E, -round(m*LOG2E)))``: for a row maximum m near -1e9 (OpenFold's
mask bias) the rounding error of the separately scaled maximum, up to 64, becomes the exponent of a key whose score
equals the maximum, which should be exactly 0. Triton's interpreter rounds each operation apart and never shows it.
Subtracting before scaling, ``exp2((s - m) * LOG2E)``, is exact where s == m whatever the compiler fuses. The PTX of a
compiled kernel is text, so which form each ``ex2`` takes is checked without a GPU (:func:`unsafe_exponents`).
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
