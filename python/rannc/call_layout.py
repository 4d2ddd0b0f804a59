"""One layout per set of arguments: the same arguments passed positionally, by keyword, or
by keywords in another order, make one program ([Note: call layouts])."""
import inspect

# [Note: call layouts] The trace bakes in the arguments' structure (graph.arguments_of), so
# `model(x, y)`, `model(x=x, y=y)`, `model(x, y=y)` and a collator's dict in another order
# were each another program: traced, profiled and planned again, their stages' weights kept
# beside the first's, and the warning blamed a number that changes. Python binds them all to
# the same parameters, so a call is put in the layout of the first call that passed the
# same parameter names (positional names, then keywords in its order) before anything
# reads its structure. Names that only **kwargs takes keep their relative order (a forward
# may iterate them), and a call that overflows into *args is left as it is.


class CallLayouts:
    """Rewrites each call in the layout of the first call with the same argument names."""

    def __init__(self, signature: inspect.Signature):
        params = signature.parameters.values()
        self.positional = [p.name for p in params
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.named = {p.name for p in params
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self._layouts = {}   # frozenset of names -> (positional names, keyword names)
        self._targets = {}   # (number positional, keyword names) -> a layout, or None: as is

    def arrange(self, args: tuple, kwargs: dict):
        key = (len(args), tuple(kwargs))
        if key not in self._targets:
            self._targets[key] = self._target(*key)
        target = self._targets[key]
        if target is None:
            return args, kwargs
        values = dict(zip(self.positional, args))
        values.update(kwargs)
        positional, keywords = target
        return tuple(values[n] for n in positional), {n: values[n] for n in keywords}

    def _target(self, positional: int, keywords: tuple):
        if positional > len(self.positional) or set(keywords) & set(self.positional[:positional]):
            return None  # *args, or a name given twice: Python's own error, unchanged
        layout = (tuple(self.positional[:positional]), keywords)
        names = frozenset(layout[0] + keywords)
        first = self._layouts.setdefault(names, layout)
        if first == layout:
            return None
        extra = [n for n in keywords if n not in self.named]  # taken by **kwargs
        if extra != [n for n in first[1] if n not in self.named]:
            return None
        return first
