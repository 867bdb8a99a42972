import os
import sys

# The tiny Hugging Face checkpoint builders live with the model tests.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "models"))
