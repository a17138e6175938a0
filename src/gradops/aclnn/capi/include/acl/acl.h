/* gradops' CANN C surface: AscendCL's entry header (initialisation, the runtime, the base types). */
#ifndef GRADOPS_CANN_ACL_H_
#define GRADOPS_CANN_ACL_H_

#include "acl_base.h"
#include "acl_rt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Initialise AscendCL (configPath: NULL, or a JSON file, not read). A second call without aclFinalize returns
 * ACL_ERROR_REPEAT_INITIALIZE, as CANN does. */
ACL_FUNC_VISIBILITY aclError aclInit(const char *configPath);
/* Undo aclInit (ACL_ERROR_REPEAT_FINALIZE without it). The embedded Python interpreter that runs gradops stays:
 * it cannot be restarted in the same process. */
ACL_FUNC_VISIBILITY aclError aclFinalize(void);
ACL_FUNC_VISIBILITY aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion, int32_t *patchVersion);

#ifdef __cplusplus
}
#endif

#endif /* GRADOPS_CANN_ACL_H_ */
