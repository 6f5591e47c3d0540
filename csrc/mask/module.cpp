// Python module init for meshkern._mask_C; the ops register in the other files.
#include "pymodule.h"
MESHKERN_PYMODULE(_mask_C)
