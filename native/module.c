/* The Python extension wrapper of kernels.c: an empty module, so that setuptools builds and
 * installs the shared object; ringreduce/kernels.py loads it with ctypes. */
#include <Python.h>

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "ringreduce CPU kernels (called through ctypes)", -1, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
