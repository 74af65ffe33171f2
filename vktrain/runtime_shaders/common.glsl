// Conventions shared by vktrain shaders. Include with:
//   #extension GL_GOOGLE_include_directive : require
//   #include "common.glsl"
#ifndef VKTRAIN_COMMON_GLSL
#define VKTRAIN_COMMON_GLSL

// Local size from specialization constants 0, 1, 2 (Dispatch.local_size sets them); a kernel's own
// specialization constants start at id 3. Use as a statement:  VKTRAIN_LOCAL_SIZE_FROM_SPEC;
#define VKTRAIN_LOCAL_SIZE_FROM_SPEC layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in

// Split dispatches. A shader whose push-constant block starts with VKTRAIN_PUSH_HEADER may be
// dispatched with more work groups than the device's maxComputeWorkGroupCount: the runtime records
// several dispatches and writes each one's first group into the header (zero when not split). Such a
// shader must index work with VKTRAIN_GLOBAL_GROUP_ID / VKTRAIN_GLOBAL_INVOCATION_ID, never with raw
// gl_WorkGroupID / gl_GlobalInvocationID / gl_NumWorkGroups. The Dispatch's push_constants are the
// bytes after the header (offset 16). Example:
//   layout(push_constant, std430) uniform Push { VKTRAIN_PUSH_HEADER; uint n; float alpha; } pc;
//   uint i = VKTRAIN_GLOBAL_INVOCATION_ID(pc).x;
// Shaders without the header are never split (a dispatch over the limit is refused).
#define VKTRAIN_PUSH_HEADER uvec4 vktrain_group_offset
#define VKTRAIN_GLOBAL_GROUP_ID(push) (gl_WorkGroupID + (push).vktrain_group_offset.xyz)
#define VKTRAIN_GLOBAL_INVOCATION_ID(push) (VKTRAIN_GLOBAL_GROUP_ID(push) * gl_WorkGroupSize + gl_LocalInvocationID)

#endif
