// Workgroup reductions through subgroup operations, for the SUBGROUPS bodies (device feature "subgroup")
// of kernels with a one-dimensional workgroup of WG threads: each subgroup reduces its values with one
// subgroup operation, its first lane stores the result, and after one barrier every thread combines the
// subgroups' results in subgroup order, so all threads get the same value (two barriers in all, where
// the workgroup-memory tree of the default bodies takes log2(WG) + 1). The order of the additions is the
// subgroup operation's (fixed by the device) then the subgroups' order: as deterministic as the tree,
// but a different order, so results differ from the default body's within the usual bound of a
// floating-point sum in any order, (n - 1) u sum |x_i| for n terms (u = 2^-24).
// `SubgroupPlace` is the thread's subgroup_id, num_subgroups and subgroup_invocation_id built-ins.

struct SubgroupPlace {
    id: u32,
    count: u32,
    lane: u32,
}

var<workgroup> subgroup_results: array<f32, WG>;  // [subgroup id]: at most WG subgroups

fn workgroup_sum_by_subgroups(value: f32, place: SubgroupPlace) -> f32 {
    let total = subgroupAdd(value);
    if (place.lane == 0u) {
        subgroup_results[place.id] = total;
    }
    workgroupBarrier();
    var sum = subgroup_results[0];
    for (var i = 1u; i < place.count; i++) {
        sum += subgroup_results[i];
    }
    workgroupBarrier();  // every thread has read the results before the next reduction writes them
    return sum;
}

fn workgroup_max_by_subgroups(value: f32, place: SubgroupPlace) -> f32 {
    let largest = subgroupMax(value);
    if (place.lane == 0u) {
        subgroup_results[place.id] = largest;
    }
    workgroupBarrier();
    var result = subgroup_results[0];
    for (var i = 1u; i < place.count; i++) {
        result = max(result, subgroup_results[i]);
    }
    workgroupBarrier();
    return result;
}
