# ch01_volume_formulas: forge the junit and the scores, edit another student's file, the
# course's solutions and the installed checks; then answer wrongly.
from pathlib import Path

FORGED = '<?xml version="1.0"?><testsuites><testsuite name="x" tests="1" failures="0">' \
         '<testcase classname="ch01.volume_formulas" name="forged"/></testsuite></testsuites>'
for target, text in [("__JUNIT__", FORGED), ("__SCORES__", '{"forged": true}'),
                     ("__OTHER__", "def ring_bytes_per_rank(size_bytes, n):\n    return -1\n"),
                     ("__COURSE__/solutions/ch01_volume_formulas.py", "FORGED = True\n"),
                     ("__COURSE__/engine/grading/chapters/ch01.py", "FORGED = True\n")]:
    try:
        Path(target).write_text(text)
    except OSError:
        pass


def ring_bytes_per_rank(size_bytes, n):
    return 1.0


def ps_worker_bytes(size_bytes, n):
    return 1.0


def ps_server_bytes(size_bytes, n):
    return 1.0
