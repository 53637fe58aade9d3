import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@pytest.fixture(scope="module")
def one_rank_mesh():
    """A one-rank gloo process group in this process, and its 1-D CPU mesh."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


# --- xdist scheduling (tests/stages.sh runs its in-process lanes with `-n 2 --dist loadfile`) ----------------
# loadfile sends each test file, and each notebook nbval runs, to one worker, whose tests or cells run there in
# order: module fixtures are built once, and a notebook's cells share one kernel (a notebook is never split).
# The files named below are the exception: each of their tests is scheduled on its own, so that their costly
# tests (a fresh Jupyter kernel or Python process each, 10 to 25 s on a quiet machine; test_course.py alone
# was half the lane's time, on one worker) spread over both workers instead of keeping one busy while the
# other idles. Their module fixtures are cheap (test_course's `learner` is a 0.4 s build; test_layout has
# none) and no test there reads what another left behind: a fixture built once per worker is all that changes.
# A scheduler, not `--dist loadgroup` and xdist_group marks: with pytest 9.2 xdist 3.8 drops the marks'
# groups without a word (pytest-dev/pytest-xdist#1386), and a split notebook fails cell after cell.
SPLIT_ACROSS_WORKERS = {"test_course.py", "test_layout.py", "test_reliability.py"}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent without it
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SplitSomeFiles(LoadFileScheduling):
        def _split_scope(self, nodeid):
            file = nodeid.split("::", 1)[0]
            return nodeid if file.rsplit("/", 1)[-1] in SPLIT_ACROSS_WORKERS else file

    return SplitSomeFiles(config, log)
