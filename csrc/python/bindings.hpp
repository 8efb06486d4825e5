// The parts of elasticstore._C, each binding one side of the store; bindings.cpp makes the module.
#pragma once

#include <pybind11/pybind11.h>

namespace elasticstore::bindings {

void bind_server(pybind11::module_& m);  // Server (bind_server.cpp)
void bind_client(pybind11::module_& m);  // Client and Heartbeat (bind_client.cpp)

}  // namespace elasticstore::bindings
