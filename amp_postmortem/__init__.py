"""amp-postmortem analyzer: reads a recorded run on any machine and answers
the post-mortem questions of a diverged mixed-precision training job."""
__version__ = "0.1.0"
