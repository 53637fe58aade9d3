"""``python -m dmuon_edu.course build [--force] | restore NN | sync-check | execute [NN] | check [NN]`` (see :mod:`dmuon_edu.course.cli`)."""

import sys

from dmuon_edu.course.cli import main

sys.exit(main())
