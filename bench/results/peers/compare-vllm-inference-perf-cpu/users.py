#!/usr/bin/env python3
"""Where each user's requests went (a user: a group's prompt with that
user's question, the same on every request: its last block's hash), and
the requests each replica served, from a sidecar journal
(HEARTH_JOURNAL_FILE): usage users.py journal.jsonl"""
import collections, json, sys

users = collections.defaultdict(collections.Counter)
served = collections.Counter()
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d.get("chosen"):
        replica = d["chosen"].rsplit("-", 1)[-1]
        users[d["first_hash"][:6], d["last_hash"][:6]][replica] += 1
        served[replica] += 1
homes = collections.Counter(c.most_common(1)[0][0] for c in users.values())
print(f"{len(users)} users; requests per replica {dict(sorted(served.items()))}; "
      f"users by the replica that served most of their requests {dict(sorted(homes.items()))}")
