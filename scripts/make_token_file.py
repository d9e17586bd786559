#!/usr/bin/env python3
"""Writes a pre-tokenized file that the trainer reads with --data tokens:PATH (common/data.c).

Format (little-endian, described in common/DATA.md):
    8 bytes   magic b"LLMTOK1\\0"
    u32       bytes per token, 2 or 4
    u32       reserved, 0
    u64       token count
    count * (bytes per token)   the token ids

Inputs:
    --text FILE   the file's bytes are the tokens (ids 0..255, as the text:PATH source reads it)
    --ids FILE    whitespace- or comma-separated decimal ids ("-" reads standard input)
Each a regular file (not a FIFO or a device), each option given once. Bad input: one line, exit 2,
before anything is read or written.

    python3 scripts/make_token_file.py --ids ids.txt --vocab-size 32000 out.tok
"""
import argparse
import array
import os
import re
import stat
import struct
import sys

MAGIC = b"LLMTOK1\0"


def fail(message):
    """Bad input: one line, exit status 2 (the trainer's convention)."""
    print(f"make_token_file: {message}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """argparse, with its errors in the script's one line (not usage and error on four), exit 2."""

    def error(self, message):
        fail(f"{message} (see --help)".replace("\n", " "))


class Once(argparse.Action):
    """Stores an option's value, refusing the option given twice: the last one would silently win."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option_string} given twice")
        setattr(namespace, self.dest, values)


def check_input(path):
    """Before reading anything: the input is a regular file (a FIFO would block until a writer comes,
    a device such as /dev/zero would be read without end); '-' for --ids is standard input."""
    if path == "-":
        return
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        fail(f"{path}: {e.strerror}")
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device" \
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
        fail(f"{path}: is {kind}; the input must be a regular file")


def check_output(path, source):
    """Before reading anything: the output's directory exists and takes a new file, and the output is
    a regular file or does not exist (a rename would replace a FIFO, a device or a symbolic link),
    not read-only (whoever runs this: root's writes pass any permission check), and not the input."""
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        fail(f"{path}: directory {parent} does not exist")
    if os.path.lexists(path):
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            fail(f"{path}: is {kind}; give a file name")
        if not mode & 0o222:
            fail(f"{path}: is read-only, which writing the output would replace")
        if source not in (None, "-") and os.path.exists(source) and os.path.samefile(path, source):
            fail(f"{path}: is the input {source}; give another output name")
    probe = f"{path}.tmp.{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as e:
        fail(f"{path}: cannot create a file there ({e.strerror})")


def read_ids(path):
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="ascii").read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"{path}: {e.strerror if isinstance(e, OSError) else 'not ASCII text'}")
    fields = [f for f in re.split(r"[\s,]+", text) if f]
    ids = []
    for position, field in enumerate(fields):
        if not re.fullmatch(r"[0-9]+", field):
            fail(f"{path}: id {position} is '{field}', not a non-negative integer")
        ids.append(int(field))
    return ids


def choose_width(ids, requested):
    largest = max(ids, default=0)
    width = requested or (2 if largest < 1 << 16 else 4)
    if largest >= 1 << (8 * width):
        fail(f"id {largest} does not fit in {width} bytes per token")
    return width


def encode(ids, width):
    # array's 'H' and 'I' are 2 and 4 bytes on every platform CPython supports; checked anyway.
    values = array.array("H" if width == 2 else "I", ids)
    assert values.itemsize == width
    if sys.byteorder != "little":
        values.byteswap()
    return struct.pack("<8sIIQ", MAGIC, width, 0, len(ids)) + values.tobytes()


def write_atomically(path, blob):
    # A crash mid-write must not leave a truncated file under the final name.
    # A failed write (a full disk, a file-size limit) leaves nothing behind and says why in one line.
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        fail(f"{path}: cannot write ({e.strerror})")


def main():
    # No abbreviations (--wid): an option is named in full, so that Once sees every repeat of it.
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", metavar="FILE", action=Once, help="use the file's bytes as tokens")
    source.add_argument("--ids", metavar="FILE", action=Once, help="decimal token ids, '-' for standard input")
    parser.add_argument("--width", type=int, choices=(2, 4), action=Once,
                        help="bytes per token (default: 2 if every id fits)")
    parser.add_argument("--vocab-size", type=int, action=Once, help="refuse ids >= this (what the C reader checks)")
    parser.add_argument("output")
    args = parser.parse_args()

    if args.vocab_size is not None and args.vocab_size < 1:
        fail(f"--vocab-size {args.vocab_size}: must be at least 1")
    source = args.text if args.text is not None else args.ids
    check_input(source)
    check_output(args.output, source)
    if args.text is not None:
        try:
            with open(args.text, "rb") as f:
                ids = list(f.read())
        except OSError as e:
            fail(f"{args.text}: {e.strerror}")
    else:
        ids = read_ids(args.ids)
    if args.vocab_size is not None:
        for position, token in enumerate(ids):
            if token >= args.vocab_size:
                fail(f"token {position} is {token}, not below --vocab-size {args.vocab_size}")
    if len(ids) < 2:  # the trainer needs seq_len + 1 tokens for one sequence (an input and its target)
        fail(f"{args.text if args.text is not None else args.ids}: {len(ids)} token(s): a token file needs at least 2")
    width = choose_width(ids, args.width)
    write_atomically(args.output, encode(ids, width))
    print(f"make_token_file: wrote {args.output}: {len(ids)} tokens x {width} bytes")


if __name__ == "__main__":
    main()
