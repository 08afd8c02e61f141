import os

import pytest

# Every test run shares one token cache (the stdlib is tokenized once per session) and keeps
# W&B offline and quiet; tests never reach the network.
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("plait-cache")
    previous = os.environ.get("PLAIT_CACHE_DIR")
    os.environ["PLAIT_CACHE_DIR"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("PLAIT_CACHE_DIR", None)
    else:
        os.environ["PLAIT_CACHE_DIR"] = previous
