#!/usr/bin/env python3
"""CPU time of each test of a ctest build, each run alone: the commands ctest lists
(`ctest -N --show-only=json-v1`), the Python files and the fuzz targets' corpus replays one by one
and each GoogleTest program once,
each under getrusage of its children (servers a test starts and waits for count; processes it
leaves behind do not). Prints one line per test (wall s, CPU s, exit status) and the totals.

    cd build/ci && python3 ../../bench/suite_cpu.py           # the release build's tests
    cd build/asan && python3 ../../bench/suite_cpu.py         # the sanitizer build's (set ASAN_OPTIONS as test.sh does)
"""
import json
import os
import resource
import subprocess
import sys
import time


def main():
    listed = json.loads(subprocess.run(["ctest", "-N", "--show-only=json-v1"], check=True, capture_output=True,
                                       text=True).stdout)
    seen, wall_sum, cpu_sum = set(), 0.0, 0.0
    for test in listed["tests"]:
        command = test.get("command")
        if not command or test["name"] == "generate_test_models":
            continue
        props = {p["name"]: p["value"] for p in test.get("properties", [])}
        name = test["name"]
        if not name.startswith(("python_", "fuzz_replay_")):  # a GoogleTest case: its program, once
            if command[0] in seen:
                continue
            seen.add(command[0])
            command, name = [command[0]], os.path.basename(command[0])
        env = dict(os.environ)
        for kv in props.get("ENVIRONMENT", []):
            k, v = kv.split("=", 1)
            env[k] = v
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        rc = subprocess.run(command, cwd=props.get("WORKING_DIRECTORY"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode
        after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - start
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        wall_sum, cpu_sum = wall_sum + wall, cpu_sum + cpu
        print(f"{name:<48} {wall:8.1f} {cpu:8.1f} {rc}", flush=True)
    print(f"{'all, one after another':<48} {wall_sum:8.1f} {cpu_sum:8.1f}")


if __name__ == "__main__":
    sys.exit(main())
