"""The start-up heap, frozen once a process is ready, is out of every later collection; what is
made after it is collected as usual."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_freezing_keeps_the_startup_heap_out_of_collections_and_collects_later_garbage() -> None:
    # NOTE: in a process of its own: a frozen heap stays frozen for the rest of the process.
    script = textwrap.dedent(
        """
        import gc, weakref
        from npuserve.deploy.gc_heap import freeze_startup_heap

        class Node:
            pass

        kept = [Node() for _ in range(1000)]
        garbage = Node(); garbage.me = garbage; watch = weakref.ref(garbage); del garbage
        freeze_startup_heap()
        assert watch() is None, "what start-up left behind is collected first"
        tracked = {id(o) for o in gc.get_objects()}
        assert gc.get_freeze_count() >= 1000 and not any(id(k) in tracked for k in kept)

        later = Node(); later.me = later; watch = weakref.ref(later); del later
        gc.collect()
        assert watch() is None, "a cycle made after the freeze is collected"
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
