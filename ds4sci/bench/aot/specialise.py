"""What Triton's JIT specialises a recorded launch on, and the ``ASTSource`` that compiles it ahead of time.

Triton specialises every integer argument on ``== 1`` (a compile-time constant) and on divisibility by 16, every
pointer on its dtype and 16-byte alignment, honouring each parameter's ``do_not_specialize``; a parameter annotated
with a dtype (``eps: tl.float64``) takes that type, unspecialised if a float or bool. The recorded (kernel, arguments,
keywords) of a launch pass through Triton's own argument specialisation (``native_specialize_impl``, what
``JITFunction.run`` calls), so two launches with one :func:`specialisation_key` compile to the same code.
"""
from __future__ import annotations


def specialisation(kernel, args, meta, backend) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) Triton's JIT derives from these arguments."""
    from triton.runtime.jit import native_specialize_impl

    names = kernel.arg_names
    options = {key: value for key, value in meta.items() if key not in names}  # num_warps, num_stages
    constexprs = {key: value for key, value in meta.items() if key in names}
    runtime_names = [name for name in names if name not in constexprs]
    if len(runtime_names) != len(args):
        raise ValueError(f"{kernel.__name__}: {len(args)} arguments for parameters {runtime_names}")
    signature, attrs = {}, {}
    fixed, unaligned = _not_specialised(kernel)
    annotated = _annotated_types(kernel)
    for name, arg in zip(runtime_names, args):
        # (type, specialisation): e.g. ("*fp16", "D") for a 16-byte aligned pointer, ("constexpr", 1), ("i32", "");
        # arguments the kernel marks ``do_not_specialize`` (``_on_alignment``) are not, as in JITFunction.run
        ty, desc = native_specialize_impl(backend, arg, False, name not in fixed, name not in unaligned)
        if name in annotated:  # as JITFunction.run: the annotation's type; floats and bools not specialised
            ty, desc = annotated[name], (None if annotated[name][:2] in ("fp", "bf", "u1") else desc)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = arg
        elif desc:
            attrs[(names.index(name),)] = backend.parse_attr(desc)
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs, attrs, options


def _not_specialised(kernel) -> tuple[set[str], set[str]]:
    """Names of the parameters the kernel marks ``do_not_specialize`` and ``do_not_specialize_on_alignment``, from a
    JIT function (its params) or an interpreted one (the keywords ``@triton.jit`` was given: names or indices)."""
    if hasattr(kernel, "params"):
        return ({p.name for p in kernel.params if p.do_not_specialize},
                {p.name for p in kernel.params if p.do_not_specialize_on_alignment})
    keywords = getattr(kernel, "kwargs", {})

    def names(key):
        return {kernel.arg_names[x] if isinstance(x, int) else x for x in keywords.get(key) or ()}

    return names("do_not_specialize"), names("do_not_specialize_on_alignment")


def _annotated_types(kernel) -> dict[str, str]:
    """Parameters annotated with a dtype (``eps: tl.float64``, a string under postponed annotations) -> its name
    (``"fp64"``), from a JIT or an interpreted function."""
    import inspect

    import triton.language as tl

    types = {}
    for name, p in inspect.signature(getattr(kernel, "fn", kernel)).parameters.items():
        annotation = p.annotation
        if isinstance(annotation, str) and annotation.startswith("tl."):
            annotation = getattr(tl, annotation[3:], None)
        if isinstance(annotation, tl.dtype):
            types[name] = annotation.name
    return types


def meta_names(kernel) -> set[str]:
    """The kernel's own ``tl.constexpr`` parameters (flags and tiles), as opposed to arguments Triton specialised."""
    return {p.name for p in kernel.params if p.is_constexpr} if hasattr(kernel, "params") else set()


def describe_specialisation(kernel, signature: dict, constexprs: dict, attrs: dict) -> str:
    """What Triton specialised this launch on, beyond the flags: unit and non-multiple-of-16 integer arguments,
    pointer dtypes and unaligned pointers (e.g. ``==1: N, stride_ph; not %16: S, D, stride_pj; Mask *fp32``)."""
    names = kernel.arg_names
    unit = [n for n, v in constexprs.items() if not isinstance(v, bool) and v == 1 and n not in meta_names(kernel)]
    ints = [n for n, ty in signature.items() if ty in ("i32", "i64") and (names.index(n),) not in attrs]
    ptrs = [f"{n} {ty}" for n, ty in signature.items() if ty.startswith("*")]
    unaligned = [n for n, ty in signature.items() if ty.startswith("*") and (names.index(n),) not in attrs]
    parts = [f"==1: {', '.join(unit)}" if unit else "", f"not %16: {', '.join(ints)}" if ints else "",
             f"unaligned: {', '.join(unaligned)}" if unaligned else "", ", ".join(ptrs)]
    return "; ".join(part for part in parts if part)


def specialisation_key(variant, kernel, args, meta, backend) -> str:
    """Two launches with one key compile to the same code (``variant``: a variant of :mod:`.variants`, for its kernel
    name)."""
    signature, constexprs, attrs, options = specialisation(kernel, args, meta, backend)
    return repr((variant.kernel, sorted(signature.items()), sorted(constexprs.items()), sorted(attrs.items()),
                 sorted(options.items())))


def ast_source(kernel, args, meta, backend):
    """ASTSource with the signature/constexprs/attrs Triton's JIT would derive from these arguments, and the
    compile options."""
    import triton

    signature, constexprs, attrs, options = specialisation(kernel, args, meta, backend)
    return triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), options
