"""Child processes that a test interrupts with SIGINT, as a user's Ctrl-C.

A shell that starts a job in the background without job control (`cmd &`
in a script, `nohup`, some CI runners) starts it with SIGINT ignored, and
every process it starts inherits that: Python then installs no
KeyboardInterrupt handler, and a SIGINT the test sends does nothing. The
child gets SIGINT's default back before it runs, as a terminal's
process has it, whatever ran the suite."""
from __future__ import annotations

import signal


def default_sigint() -> None:
    """`subprocess.Popen(..., preexec_fn=default_sigint)`."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
