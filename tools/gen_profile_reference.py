"""Write docs/profile-reference.md from the profile's schema (`testbed.run.profile_reference`).

    python tools/gen_profile_reference.py           # (re)write the file
    python tools/gen_profile_reference.py --check   # exit 1 if the file differs from the schema

tests/run/test_profile_reference.py runs the check: a schema change without the regenerated file fails it.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from testbed.run.profile_reference import DOC, reference_markdown

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 when the file is out of date")
    args = p.parse_args(argv)
    text = reference_markdown()
    if args.check:
        current = DOC.read_text() if DOC.is_file() else ""
        if current != text:
            print(f"{DOC} is out of date: python tools/gen_profile_reference.py rewrites it", file=sys.stderr)
            return 1
        print(f"{DOC} is current")
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
