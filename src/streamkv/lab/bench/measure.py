"""Transitional re-export of :mod:`streamkv.lab.measure` (the instruments moved there, shared by
the bench and the experiments); import from :mod:`streamkv.lab.measure`."""

from streamkv.lab.measure import *  # noqa: F401,F403
from streamkv.lab.measure import __all__  # noqa: F401
