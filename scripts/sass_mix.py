"""Executed warp instructions by opcode (and warp-stall samples) of one kernel, from
`ncu --page source --csv --print-source sass` (scripts/prefill_round.sh). Usage: sass_mix.py FILE [TOP]"""
import collections
import csv
import sys


def main(path: str, top: int = 24) -> None:
    with open(path, newline="") as f:
        r = csv.reader(f)
        next(r)  # the kernel's name
        hdr = next(r)
        ia, isrc = hdr.index("Instructions Executed"), hdr.index("Source")
        iss = hdr.index("Warp Stall Sampling (All Samples)")
        mix, stalls = collections.Counter(), collections.Counter()
        for row in r:
            try:
                n, s = int(row[ia]), int(row[iss])
            except (ValueError, IndexError):
                continue
            words = row[isrc].split()
            if not words:
                continue
            op = (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]
            mix[op] += n
            stalls[op] += s
    total, samples = sum(mix.values()), max(1, sum(stalls.values()))
    print(f"executed warp instructions {total}, stall samples {samples}")
    for op, n in mix.most_common(top):
        print(f"  {op:10s} {n:12d} {100 * n / total:5.1f}%   stalls {100 * stalls[op] / samples:5.1f}%")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 24)
