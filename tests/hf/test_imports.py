"""`transformers` is an optional extra: `import offload` never imports it, and neither does
`import offload.hf` (only `offload_pretrained`, when called)."""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = """
import json, sys
seen = {}
import offload
seen["offload"] = "transformers" in sys.modules or "offload.hf" in sys.modules
import offload.hf
seen["offload.hf"] = "transformers" in sys.modules
import transformers
seen["control"] = "transformers" in sys.modules
print(json.dumps(seen))
"""


def test_transformers_is_imported_only_when_needed() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"offload": False, "offload.hf": False, "control": True}
