// The driver contract (driver_contract.h) on SimDriver.
#include "driver_contract.h"

#include "ctxpool/driver/sim_driver.h"

namespace ctxpool {
namespace testing_contract {
namespace {

absl::StatusOr<std::unique_ptr<Driver>> MakeSim() {
  return std::unique_ptr<Driver>(SimDriver::Create());
}

absl::StatusOr<std::unique_ptr<Driver>> MakeSmallSim() {
  CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<SimDriver> sim,
                           SimDriver::CreateFromSpec("sim:2xa10-24gb"));
  return std::unique_ptr<Driver>(std::move(sim));
}

INSTANTIATE_TEST_SUITE_P(
    Sim, DriverContractTest,
    ::testing::Values(DriverFactory{"h100", &MakeSim, true},
                      DriverFactory{"two_a10", &MakeSmallSim, true}),
    DriverFactoryName);

}  // namespace
}  // namespace testing_contract
}  // namespace ctxpool
