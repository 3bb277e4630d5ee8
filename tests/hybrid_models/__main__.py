"""``cd tests && python -m hybrid_models DIR``: save every family's tiny checkpoint under
``DIR/<model_type>/`` (for a machine whose transformers lacks a family, such as a GPU image:
``MCSERVE_HYBRID_FIXTURES=DIR``)."""

import sys
from pathlib import Path

from hybrid_models import FAMILIES

if __name__ == "__main__":
    out = Path(sys.argv[1])
    for name, mod in sorted(FAMILIES.items()):
        (out / name).mkdir(parents=True, exist_ok=True)
        mod.save_tiny(out / name)
        print("saved", out / name)
