"""The migration's whole diff: this module *is* distcomm, so ``from <pkg>.utils import comm`` and
``import <pkg>.utils.comm`` keep working, ``_LOCAL_PROCESS_GROUP`` included."""

import sys

import distcomm

sys.modules[__name__] = distcomm
