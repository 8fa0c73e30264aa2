"""Moved to :mod:`visattn.train.run_log`; this alias is kept for one release."""
from visattn._moved import alias_module

alias_module(__name__, "visattn.train.run_log")
