"""Generates the labs in exercises/ from the chapter code.

A chapter's module marks the parts a student writes:

        // LAB fsdp: all-gather the unit (unless prefetched), wait, prefetch the next one
        ... the solution ...
        // END LAB

For each lab name, every source file holding its markers is copied to exercises/<lab>/<file name>
with the solution replaced by a call that stops the program with the hint:

        // LAB fsdp: all-gather the unit (unless prefetched), wait, prefetch the next one
        LAB_HOLE("fsdp", "all-gather the unit (unless prefetched), wait, prefetch the next one");
        // END LAB

and exercises/<lab>/FILES lists where each file goes back in the tree (scripts/grade.sh puts it
there in a private copy, builds and runs the lab's checks). The labs' handouts (README.md) and
checks (checks) are written by hand; this script only rewrites the skeleton sources.

    make_exercises.py            regenerate exercises/*/ skeletons
    make_exercises.py --check    exit 1 if a skeleton is out of date with the chapter code
"""
import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ["chapters", "reference_cpu"]
BEGIN = re.compile(r"^(\s*)// LAB (\w+): (.+)$")
END = re.compile(r"^\s*// END LAB\s*$")


def c_string(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def skeleton(lines, lab, path):
    """The file with lab `lab`'s solutions replaced by holes (other labs' markers stay as solved code)."""
    out, inside = [], None
    for number, line in enumerate(lines, 1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin and inside is not None:
            sys.exit(f"{path}:{number}: LAB marker inside another one")
        if begin and begin.group(2) == lab:
            inside = begin
            out.append(line)
            out.append(f"{begin.group(1)}LAB_HOLE({c_string(lab)}, {c_string(begin.group(3).strip())});\n")
            continue
        if end and inside is not None:
            inside = None
            out.append(line)
            continue
        if inside is None:
            out.append(line)
    if inside is not None:
        sys.exit(f"{path}: LAB {lab} has no END LAB")
    text = "".join(out)
    if '#include "common/log.h"' not in text:  # where LAB_HOLE is declared
        first = text.index("#include")
        end = text.index("\n", first) + 1
        text = text[:end] + '#include "common/log.h"  // LAB_HOLE\n' + text[end:]
    return text


def labs_in_tree():
    """{lab: [source paths]} from the markers."""
    found = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.c")):
            for line in path.read_text().splitlines():
                m = BEGIN.match(line)
                if m:
                    found.setdefault(m.group(2), [])
                    if path not in found[m.group(2)]:
                        found[m.group(2)].append(path)
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale = []
    for lab, paths in sorted(labs_in_tree().items()):
        folder = ROOT / "exercises" / lab
        wanted = {}
        for path in paths:
            wanted[folder / path.name] = skeleton(path.read_text().splitlines(keepends=True), lab, path)
        wanted[folder / "FILES"] = "".join(f"{p.name} {p.relative_to(ROOT)}\n" for p in paths)
        for target, text in wanted.items():
            if target.exists() and target.read_text() == text:
                continue
            stale.append(str(target.relative_to(ROOT)))
            if not args.check:
                folder.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
    if args.check and stale:
        print("out of date with the chapter code (run make exercises): " + ", ".join(stale))
        return 1
    print(("checked" if args.check else "wrote") + f" {len(labs_in_tree())} labs" +
          (f"; updated {', '.join(stale)}" if stale and not args.check else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
