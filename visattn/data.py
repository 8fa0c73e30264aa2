"""Moved to :mod:`visattn.train.data`; this alias is kept for one release."""
from visattn._moved import alias_module

alias_module(__name__, "visattn.train.data")
