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

and exercises/<lab>/FILES lists where each file goes back in the tree, with the SHA-256 of the
skeleton as generated (scripts/grade.sh compiles the file in its place). The labs' handouts
(README.md), checks (checks) and planted mistakes (mutants/) are written by hand; this script only
rewrites the skeleton sources.

A skeleton whose hash no longer matches FILES has been edited: it is the student's work, and is
never overwritten. `--force` regenerates it anyway, keeping the edited one as FILE.edited (or
FILE.edited.2, .3, ... when earlier ones are there).

    make_exercises.py                 regenerate exercises/*/ skeletons (not the edited ones)
    make_exercises.py --force         regenerate every skeleton (an edited one is kept as FILE.edited)
    make_exercises.py --check         exit 1 if an unedited skeleton is out of date with the chapter code
    make_exercises.py --out DIR --lab LAB   write LAB's skeleton files to DIR/<their path in the tree>
"""
import argparse
import hashlib
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


def sha256(text):
    return hashlib.sha256(text.encode()).hexdigest()


def recorded_hashes(folder):
    """{file name: hash of the skeleton as generated} from exercises/<lab>/FILES."""
    files = folder / "FILES"
    if not files.exists():
        return {}
    return {f[0]: f[2] for f in (line.split() for line in files.read_text().splitlines()) if len(f) == 3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--lab")
    args = ap.parse_args()
    labs = labs_in_tree()
    if args.out:
        if args.lab not in labs:
            sys.exit(f"make_exercises: --out needs --lab, one of {', '.join(sorted(labs))}")
        for path in labs[args.lab]:
            target = args.out / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(skeleton(path.read_text().splitlines(keepends=True), args.lab, path))
        return 0
    stale, edited, kept = [], [], []
    for lab, paths in sorted(labs.items()):
        folder = ROOT / "exercises" / lab
        recorded = recorded_hashes(folder)
        wanted = {path.name: skeleton(path.read_text().splitlines(keepends=True), lab, path) for path in paths}
        for name, text in wanted.items():
            target = folder / name
            shown = str(target.relative_to(ROOT))
            if not target.exists():
                stale.append(shown)
            elif target.read_text() == text:
                continue
            elif sha256(target.read_text()) != recorded.get(name):
                edited.append(shown)  # the student's work
                if not (args.force and not args.check):
                    continue
                backup = target.with_name(name + ".edited")
                for n in range(2, 10000):  # an earlier FILE.edited is earlier work: never replaced
                    if not backup.exists():
                        break
                    backup = target.with_name(f"{name}.edited.{n}")
                else:
                    sys.exit(f"make_exercises: {shown}: {name}.edited to .edited.9999 all exist; move some away")
                target.replace(backup)
                kept.append(str(backup.relative_to(ROOT)))
            else:
                stale.append(shown)
            if not args.check:
                folder.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
        files = "".join(f"{p.name} {p.relative_to(ROOT)} {sha256(wanted[p.name])}\n" for p in paths)
        if not (folder / "FILES").exists() or (folder / "FILES").read_text() != files:
            if args.check:
                stale.append(str((folder / "FILES").relative_to(ROOT)))
            else:
                (folder / "FILES").write_text(files)
    if edited and not args.force:
        print("edited since they were generated (your work, left as it is; make grade LAB=<lab> grades it; "
              "make exercises FORCE=1 starts over and keeps yours as FILE.edited): " + ", ".join(edited))
    if kept:
        print("started over; your edited versions are kept as " + ", ".join(kept))
    if args.check and stale:
        print("out of date with the chapter code (run make exercises): " + ", ".join(stale))
        return 1
    print(("checked" if args.check else "wrote") + f" {len(labs)} labs" +
          (f"; updated {', '.join(stale)}" if stale and not args.check else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
