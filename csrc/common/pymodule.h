// Minimal CPython module init for an extension whose only job is to register torch
// ops as a side effect of being imported (TORCH_LIBRARY_* static initializers).
// Including <Python.h> instead of <torch/extension.h> keeps each .cpp at ~5 s of
// compile time instead of ~20 s (measured on a 2-core build machine).
#pragma once
#include <Python.h>

#define MESHKERN_PYMODULE(NAME)                                              \
  extern "C" PyObject* PyInit_##NAME(void) {                                 \
    static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, #NAME, nullptr, \
                                     -1, nullptr};                           \
    return PyModule_Create(&def);                                            \
  }
