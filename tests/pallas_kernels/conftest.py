"""Makes this folder's shared case builder (`decode_cases`) importable by its tests."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
