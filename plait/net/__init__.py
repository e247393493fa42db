"""Multi-path fabrics and traffic planning (issue 16; C4P, HPCA'25).

One job per module:

* `maxmin`   -- max-min fair rates of flows sharing links (progressive filling);
* `ecmp`     -- ECMP/bond hashing of 5-tuples and the expected maximum load of random hashing;
* `fabric`   -- the link graph of a cluster's switched fabric: candidate paths between NIC
                ports, ECMP routing per tier, failed links;
* `nccl`     -- how many flows (channels x queue pairs) NCCL opens per connection, by message size;
* `flows`    -- the inter-node flows of a plan's collectives (ring neighbours per channel and QP);
* `planner`  -- assigns each flow a path (spine, port) to balance link loads, the LP lower
                bound ("ideal"), re-planning after a link failure;
* `spray`    -- adaptive routing as per-packet spraying (fluid): every flow split evenly at
                every hop, the second baseline beside ECMP;
* `paths`    -- planned paths as `Plan.flow_paths` stores them, and back;
* `deploy`   -- settings a deployment applies (NCCL env, policy routes, per-QP source ports);
* `api`      -- `plan_traffic(plan, cluster, graph)`: all of the above in one call;
* `twolink`  -- two emulated parallel links (network namespaces, root): planned vs hashed;
* `leafspine` -- a namespace leaf/spine (4 spines) where the kernel hashes: planned vs hashed.

Layer: above `plait.cost` (it may import cost, cluster, graph, ir), below `plait.planners`,
`plait.sim` and `plait.runtime`.
"""
