"""A user's training script as the tests ship it to pods: prints what it was given."""

import json
import os
import sys

from lib.util import contract

# One write per line: the ranks of a pod share its stdout, and print() writes the text
# and the newline separately, so two ranks' lines could run together.
sys.stdout.write(json.dumps({"argv": sys.argv[1:], "contract": contract(os.environ)}) + "\n")
sys.stdout.flush()
