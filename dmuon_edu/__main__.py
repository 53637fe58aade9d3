"""``python -m dmuon_edu check [NN]``: grade your notebooks (see :mod:`dmuon_edu.course`)."""

import sys

from dmuon_edu.course import main

sys.exit(main())
