"""Every rank sleeps far past any timeout: the launcher must kill the whole job."""

import time

from dmuon_edu import distributed

with distributed.session():
    time.sleep(3600)
