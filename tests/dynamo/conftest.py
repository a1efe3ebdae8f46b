"""The Dynamo tests need Dynamo's runtime wheel, which lives in its own venv (scripts/install_dynamo.sh; `make
test-dynamo`)."""

import importlib.util

if importlib.util.find_spec("dynamo") is None:
    collect_ignore_glob = ["*.py"]
