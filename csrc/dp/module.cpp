// Python module init for meshkern._dp_C; the ops register in the other files.
#include "pymodule.h"
MESHKERN_PYMODULE(_dp_C)
