"""The error accelgen raises for bad input: a name, option, setting, prompt or file the caller gave that it cannot
use. A subclass of ValueError, so `except ValueError` (and the server's 400 answers) keep catching it.

The command line tells the two kinds of failure apart by it: an InputError (or a file that is not there) ends a
command with its message on one line and exit status 2; any other exception is a bug, shown with its traceback
and exit status 1. ACCELGEN_DEBUG=1 (or `accelgen --debug`) shows the traceback of input errors too.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input to accelgen, named in the message with what to give instead."""
