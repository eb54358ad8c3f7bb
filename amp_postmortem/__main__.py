"""`python -m amp_postmortem`: the `amp-postmortem` command, for an
environment whose scripts directory is not on PATH."""
from .cli import main

if __name__ == "__main__":  # pragma: no cover
    main(prog_name="amp-postmortem")
