"""`build_proposer(spec, target, **opts)`: a proposer from its spec string.

    none | plain        plain decoding through the speculative path (k = 0)
    ngram | ngram:N     prompt lookup (decoding/ngram.py)
    METHOD:PATH         an artifact (or, for `draft`, any HF folder) of a registered method (methods.py):
                        draft:PATH, medusa:PATH, eagle:PATH, ...
    multi:A+B           one merged tree of several proposers (decoding/multi.py)
    route:POLICY        per-domain routing between proposers (decoding/routing.py)
"""

from __future__ import annotations

from draftsmith import methods
from draftsmith.artifact import resolve_path
from draftsmith.decoding.proposer import NullProposer, Proposer
from draftsmith.errors import ConfigError


def build_proposer(spec: str, target, **opts) -> Proposer:
    kind, _, arg = spec.partition(":")
    kind = kind.strip().lower()
    if kind in ("none", "plain"):
        return NullProposer()
    if kind == "multi":
        from draftsmith.decoding.multi import build_multi

        return build_multi(arg, target, build_proposer, **opts)
    if kind == "route":
        from draftsmith.decoding.routing import RoutedProposer

        if not arg:
            raise ConfigError("proposer 'route' needs a routing policy file: route:PATH")
        return RoutedProposer.from_file(arg, target, build_proposer, **opts)
    if kind == "ngram":
        from draftsmith.decoding.ngram import NgramProposer

        if arg:
            try:
                opts.setdefault("max_ngram", int(arg))
            except ValueError:
                raise ConfigError(f"proposer '{spec}': ngram:N needs an integer N") from None
        return NgramProposer(**opts)
    method = methods.find(kind)
    if method is None:
        raise ConfigError(f"unknown proposer '{spec}' (use ngram, "
                          + ", ".join(f"{n}:PATH" for n in methods.names())
                          + ", multi:A+B, route:POLICY or none)")
    if not arg:
        raise ConfigError(f"proposer '{method.name}' needs a path: {method.name}:PATH (a draftsmith {method.name} "
                          "artifact)")
    return method.get("proposer")(target, str(resolve_path(arg)), **opts)  # zoo/<target>/<name>: shipped heads
