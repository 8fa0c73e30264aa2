"""Moved to :mod:`visattn.bench.flops`; this alias is kept for one release."""
from visattn._moved import alias_module

alias_module(__name__, "visattn.bench.flops")
