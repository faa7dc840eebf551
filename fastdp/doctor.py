"""``python -m fastdp.doctor``: the same as ``python -m fastdp doctor``
(``fastdp/commands/doctor.py``).

Imported, the name is the function: this module puts ``fastdp.doctor`` in its own place in
``sys.modules``, so ``import fastdp.doctor`` binds the function, as ``fastdp.doctor`` is.
"""

import sys

from fastdp.commands.doctor import doctor, main

if __name__ == "__main__":
    sys.exit(main())
sys.modules[__name__] = doctor
