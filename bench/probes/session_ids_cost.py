#!/usr/bin/env python3
"""What a persistent batch in the API (issue 25 item 8: an engine registers its
sessions once, each step then sends only arrays) would save the server per step:
the session ids' part of a stacked step, i.e. unpacking the list of ids from
MessagePack and looking the step's sessions up (``Store.step_group``'s key: the
owner and the ids as a tuple), per step and per item, for 64 and 256 sessions.

    python bench/probes/session_ids_cost.py
"""

from __future__ import annotations

import argparse
import json
import timeit
import uuid

import msgpack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="64,256", help="stacked steps of these many sessions")
    args = ap.parse_args()
    for n in (int(x) for x in args.sessions.split(",")):
        ids = [uuid.uuid4().hex[:24] for _ in range(n)]
        body = msgpack.packb({"sessions": ids})
        groups = {("owner", tuple(ids)): object()}

        def step() -> object:
            names = msgpack.unpackb(body)["sessions"]
            return groups.get(("owner", tuple(names)))

        per_step = timeit.timeit(step, number=20000) / 20000
        print(
            json.dumps(
                {"sessions": n, "per_step_us": round(per_step * 1e6, 2), "per_item_us": round(per_step * 1e6 / n, 3)}
            )
        )


if __name__ == "__main__":
    main()
