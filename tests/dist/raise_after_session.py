"""A script that fails after its session ended cleanly must still exit with a failure status."""

from dmuon_edu import distributed
with distributed.session():
    pass
raise ValueError("after the session")
