"""`python -m specguide.openai_api`: the same as the `specguide-openai` command."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
