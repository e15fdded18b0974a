#!/usr/bin/python3
"""Compares kvtools' renderings of a model's chat template with the reference's.

Usage: compare.py NAME CASES REFERENCE KVTOOLS. Every case must render byte for byte as the
reference renders it; where the reference fails (the template's raise_exception, or an error
jinja2 raises), kvtools must fail too, with the template's own message when it raised. Prints
the counts and every mismatch; exits 1 on any.
"""
import json
import sys


def lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def main():
    name, cases, reference, kvtools = sys.argv[1], lines(sys.argv[2]), lines(sys.argv[3]), \
        lines(sys.argv[4])
    if not (len(cases) == len(reference) == len(kvtools)):
        print("%s: %d cases, %d reference results, %d kvtools results" %
              (name, len(cases), len(reference), len(kvtools)))
        return 1
    identical = refused = 0
    mismatches = []
    for case, ref, kv in zip(cases, reference, kvtools):
        if "output" in ref:
            ok = kv.get("output") == ref["output"]
            identical += ok
        else:
            ok = "error" in kv and (ref["kind"] != "raised" or (
                kv["kind"] == "raised" and kv["error"].endswith(": " + ref["error"])))
            refused += ok
        if not ok:
            mismatches.append((case["name"], ref, kv))
    for case_name, ref, kv in mismatches:
        print("MISMATCH %s %s" % (name, case_name))
        print("  reference: %s" % json.dumps(ref, ensure_ascii=False))
        print("  kvtools:   %s" % json.dumps(kv, ensure_ascii=False))
    print("%s: %d conversations, %d rendered byte for byte as the reference, %d refused by the "
          "template as the reference refuses them, %d mismatches" %
          (name, len(cases), identical, refused, len(mismatches)))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
