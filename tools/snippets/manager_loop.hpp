// Prelude of the managers' snippets (README.md, docs/cpp.md): the trainer's side.
// Declarations only: tools/check-snippets.py compiles the snippet, it does not run it.
struct MicroBatch {};                   // the trainer's micro-batch
extern stepcore::ManagerConfig config;  // mode, optimizer, groups, params, device, comm
extern std::vector<MicroBatch> micro_batches;
extern int first, steps;   // the first step (after a resume), the last
extern float loss_tokens;  // the step's loss tokens
double lr_at(int step);    // the trainer's schedule
