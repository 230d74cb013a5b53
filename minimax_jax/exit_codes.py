"""The exit statuses of every command-line tool (``train.py``, ``infer.py``, convert, export, eval, recall).

=====  ================================================================================
 0     success
 1     runtime failure: the work started and failed (corrupt checkpoint, checksum
       mismatch, an internal error)
 2     usage error / bad input: a flag, a missing or unreadable input file, a malformed
       config / prompt file, a destination that may not be written; nothing was done
130    interrupted (Ctrl-C; 128 + SIGINT, as shells report it)
=====  ================================================================================
"""

OK = 0
FAILURE = 1
USAGE = 2
INTERRUPTED = 130

__all__ = ["OK", "FAILURE", "USAGE", "INTERRUPTED", "UsageError"]


class UsageError(ValueError):
    """A flag combination or an input the user gave that cannot work (exit status ``USAGE``)."""
