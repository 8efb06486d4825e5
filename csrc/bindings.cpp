// placeholder: replaced by the real bindings
#include <pybind11/pybind11.h>
PYBIND11_MODULE(_C, m) { m.attr("__version__") = ELASTICSTORE_VERSION; }
