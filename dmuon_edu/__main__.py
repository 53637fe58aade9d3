"""``python -m dmuon_edu check [NN]``: grade your notebooks.

Hands over to the course's command line (:mod:`dmuon_edu.course.cli`): the one library
file that imports the course.
"""

import sys

try:
    from dmuon_edu.course.cli import main
except ModuleNotFoundError as missing:
    sys.exit(f"the course's tools are not installed ({missing}): pip install -e '.[course]' (or make install)")

sys.exit(main())
