"""``python -m elasticstore.launch``: the legacy ``torch.distributed.launch`` form.

The flags of ``elasticstore-run`` plus ``--use-env``; without it each worker also gets
``--local-rank=N`` as its first argument (``LOCAL_RANK`` is set either way), as torch's did.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .run import main as _run_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    return _run_main(argv, legacy=True, prog="elasticstore.launch")


if __name__ == "__main__":
    sys.exit(main())
