"""Hand-made benchmark CSVs for the report-tool tests (roofline, summary, compare)."""
import csv
import os


def write_csv(path, rows):
    """rows (dicts) as a CSV at path, columns in first-seen order over all rows; makes the folder."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
